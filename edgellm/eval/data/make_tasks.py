"""Regenerate tasks.jsonl: structured-extraction items written for edgellm (deterministic, seed 6).

Run: python -m edgellm.eval.data.make_tasks > edgellm/eval/data/tasks.jsonl
Ten English and ten Chinese items per scenario; values are drawn from the hand-written lists below.
"""

from __future__ import annotations

import json
import random
from typing import Any, Iterator

DATE = {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$", "description": "ISO date YYYY-MM-DD"}
TIME = {"type": "string", "pattern": r"^\d{2}:\d{2}$", "description": "24-hour time HH:MM"}


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


HEALTH = _obj({
    "symptom": {"type": "string", "description": "the main symptom, as written in the note"},
    "duration_days": {"type": "integer", "minimum": 0},
    "severity": {"type": "string", "enum": ["mild", "moderate", "severe"]},
})
RECEIPT = _obj({"merchant": {"type": "string"}, "amount": {"type": "number"}, "date": DATE})
SCHEDULE = _obj({"time": TIME, "place": {"type": "string"},
                 "people": {"type": "array", "items": {"type": "string"}, "minItems": 1}})
CLASSIFY = _obj({"label": {"type": "string", "enum": ["complaint", "praise", "question", "request"]},
                 "reason": {"type": "string", "minLength": 1}})
WEATHER = _obj({"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}})
ALARM = _obj({"time": TIME, "label": {"type": "string"}, "repeat_daily": {"type": "boolean"}})
SEND = _obj({"recipient": {"type": "string"}, "message": {"type": "string"}})

EN_SYMPTOMS = ["headache", "sore throat", "cough", "back pain", "fever", "stomach ache", "dizziness", "rash",
               "knee pain", "runny nose"]
ZH_SYMPTOMS = ["头痛", "喉咙痛", "咳嗽", "腰痛", "发烧", "胃痛", "头晕", "皮疹", "膝盖痛", "流鼻涕"]
SEVERITY_EN = {"mild": ["mild", "slight", "not too bad"], "moderate": ["moderate", "noticeable", "fairly bad"],
               "severe": ["severe", "very bad", "unbearable"]}
SEVERITY_ZH = {"mild": ["轻微", "不太严重"], "moderate": ["中等", "比较明显"], "severe": ["严重", "非常厉害"]}
ZH_NUM = ["零", "一", "两", "三", "四", "五", "六", "七", "八", "九", "十"]
EN_NUM = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
EN_MERCHANTS = ["Blue Bottle Coffee", "Tesco", "Shell", "IKEA", "Walgreens", "Trader Joe's", "Uniqlo", "Boots",
                "Costa Coffee", "Whole Foods"]
ZH_MERCHANTS = ["星巴克", "全家便利店", "永辉超市", "海底捞", "屈臣氏", "瑞幸咖啡", "盒马鲜生", "优衣库", "中国石化",
                "美宜佳"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
EN_PLACES = ["Room 4B", "the library", "Cafe Nero on King Street", "Conference Room A", "the main lobby",
             "Lab 2", "the park entrance", "Gate 12", "the town hall", "Studio 5"]
ZH_PLACES = ["三楼会议室", "图书馆", "公司前台", "星巴克中关村店", "二号实验室", "人民公园东门", "体育馆", "A座101",
             "学校食堂", "火车站南广场"]
EN_PEOPLE = ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "Jack"]
ZH_PEOPLE = ["张伟", "李娜", "王芳", "刘洋", "陈静", "杨磊", "赵敏", "黄强", "周婷", "吴浩"]
EN_CITIES = ["London", "Paris", "Tokyo", "Berlin", "Madrid", "Toronto", "Sydney", "Chicago", "Rome", "Seoul"]
ZH_CITIES = ["北京", "上海", "广州", "深圳", "杭州", "成都", "武汉", "西安", "南京", "重庆"]
EN_CLASSIFY = [
    ("complaint", "My order arrived two weeks late and the box was crushed. This is unacceptable."),
    ("complaint", "The app logs me out every five minutes. Very annoying."),
    ("praise", "The nurse on the night shift was incredibly kind to my father. Thank you!"),
    ("praise", "Great service today, the repair took only twenty minutes."),
    ("question", "Do you deliver on Sundays, and is there an extra fee?"),
    ("question", "How long does the battery last on a full charge?"),
    ("request", "Please cancel my subscription from next month."),
    ("request", "Could you send me a copy of the invoice for March?"),
    ("complaint", "I was charged twice for the same ticket."),
    ("request", "Please change my delivery address to 14 Elm Road."),
]
ZH_CLASSIFY = [
    ("complaint", "快递晚到了两个星期，盒子还被压坏了，太让人失望了。"),
    ("complaint", "这个应用每隔五分钟就把我踢下线，非常烦人。"),
    ("praise", "夜班护士对我父亲特别耐心，真的非常感谢！"),
    ("praise", "今天的服务很好，二十分钟就修好了。"),
    ("question", "你们周日送货吗？需要额外收费吗？"),
    ("question", "这款耳机充满电能用多久？"),
    ("request", "请从下个月开始取消我的订阅。"),
    ("request", "麻烦把三月份的发票发给我一份。"),
    ("complaint", "同一张票被扣了两次钱。"),
    ("request", "请把我的收货地址改成榆树路14号。"),
]


def _health(rng: random.Random, i: int, zh: bool) -> tuple[str, dict[str, Any]]:
    days = rng.randint(1, 10)
    sev = rng.choice(list(SEVERITY_EN))
    if zh:
        s = ZH_SYMPTOMS[i]
        word = rng.choice(SEVERITY_ZH[sev])
        text = rng.choice([
            f"患者自述{s}已经{ZH_NUM[days]}天了，程度{word}，夜里睡不好。",
            f"健康日记：这{ZH_NUM[days]}天一直{s}，感觉{word}，今天去药店买了药。",
            f"{s}，持续{days}天，{word}。没有其他不适。",
        ])
        return text, {"symptom": s, "duration_days": days, "severity": sev}
    s = EN_SYMPTOMS[i]
    word = rng.choice(SEVERITY_EN[sev])
    text = rng.choice([
        f"Patient reports a {word} {s} for the past {EN_NUM[days]} day{'s' if days > 1 else ''}; sleeping poorly.",
        f"Health diary: {s} again today. It started {days} day{'s' if days > 1 else ''} ago and it's {word}.",
        f"Note to self - {s}, {word}, going on for {EN_NUM[days]} day{'s' if days > 1 else ''} now. Drinking lots of water.",
    ])
    return text, {"symptom": s, "duration_days": days, "severity": sev}


def _receipt(rng: random.Random, i: int, zh: bool) -> tuple[str, dict[str, Any]]:
    y, m, d = 2025, rng.randint(1, 12), rng.randint(1, 28)
    amount = round(rng.uniform(3, 400), 2)
    merchant = (ZH_MERCHANTS if zh else EN_MERCHANTS)[i]
    gold: dict[str, Any] = {"merchant": merchant, "amount": amount, "date": f"{y}-{m:02d}-{d:02d}"}
    if zh:
        text = rng.choice([
            f"{gold['merchant']}\n交易时间：{y}年{m}月{d}日 18:42\n合计：¥{amount:.2f}\n谢谢惠顾",
            f"今天（{y}/{m}/{d}）在{gold['merchant']}花了{amount:.2f}元。",
            f"【电子小票】商户：{gold['merchant']}  日期：{y}-{m:02d}-{d:02d}  实付金额 {amount:.2f} 元",
        ])
    else:
        text = rng.choice([
            f"{gold['merchant'].upper()}\nDate: {d:02d}/{m:02d}/{y}\nTOTAL  ${amount:.2f}\nThank you for shopping!",
            f"Spent ${amount:.2f} at {gold['merchant']} on {MONTHS[m - 1]} {d}, {y}.",
            f"Receipt - {gold['merchant']} - {y}-{m:02d}-{d:02d} - amount paid: {amount:.2f} USD",
        ])
    return text, gold


def _schedule(rng: random.Random, i: int, zh: bool) -> tuple[str, dict[str, Any]]:
    h, mi = rng.randint(8, 19), rng.choice([0, 15, 30, 45])
    names = rng.sample(ZH_PEOPLE if zh else EN_PEOPLE, rng.randint(1, 3))
    place = (ZH_PLACES if zh else EN_PLACES)[i]
    gold = {"time": f"{h:02d}:{mi:02d}", "place": place, "people": names}
    if zh:
        who = "、".join(names)
        half = "下午" if h >= 12 else "上午"
        hh = h - 12 if h > 12 else h
        clock = f"{hh}点" + ("" if mi == 0 else ("半" if mi == 30 else f"{mi}分"))
        text = rng.choice([
            f"明天{half}{clock}和{who}在{place}碰头，讨论项目进度。",
            f"提醒：{h:02d}:{mi:02d}，{place}，参加人：{who}。",
            f"周五{half}{clock}，我约了{who}在{place}见面。",
        ])
    else:
        who = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        ampm = f"{(h - 1) % 12 + 1}:{mi:02d} {'PM' if h >= 12 else 'AM'}"
        text = rng.choice([
            f"Meeting with {who} at {ampm} tomorrow in {place} to go over the budget.",
            f"Reminder: {h:02d}:{mi:02d}, {place}, with {who}.",
            f"Lunch plans: meet {who} at {place}, {ampm} on Friday.",
        ])
    return text, gold


def _tool(rng: random.Random, i: int, zh: bool) -> tuple[str, dict[str, Any], dict[str, Any]]:
    kind = i % 3
    if kind == 0:
        city, days = (ZH_CITIES if zh else EN_CITIES)[i], rng.randint(1, 7)
        unit = rng.choice(["celsius", "fahrenheit"])
        gold = {"city": city, "days": days, "unit": unit}
        if zh:
            u = "摄氏度" if unit == "celsius" else "华氏度"
            text = f"调用 get_weather：帮我查一下{city}未来{ZH_NUM[days]}天的天气，温度用{u}。"
        else:
            text = f"Call get_weather: what's the weather in {city} for the next {EN_NUM[days]} days, in {unit}?"
        return text, WEATHER, gold
    if kind == 1:
        h, mi = rng.randint(5, 9), rng.choice([0, 10, 20, 30, 45])
        daily = rng.random() < 0.5
        label = rng.choice(["吃药", "晨跑", "开会"] if zh else ["take medicine", "morning run", "standup"])
        gold = {"time": f"{h:02d}:{mi:02d}", "label": label, "repeat_daily": daily}
        if zh:
            rep = "每天都提醒" if daily else "只提醒这一次"
            text = f"调用 set_alarm：早上{h}点{mi if mi else '整'}{'分' if mi else ''}叫我{label}，{rep}。"
        else:
            rep = "every day" if daily else "just once"
            text = f"Call set_alarm: wake me at {h}:{mi:02d} AM to {label}, {rep}."
        return text, ALARM, gold
    who = rng.choice(ZH_PEOPLE if zh else EN_PEOPLE)
    msg = rng.choice(["我晚上七点到", "会议推迟到明天", "记得带伞"] if zh else
                     ["I'll be there at seven", "the meeting moved to tomorrow", "bring an umbrella"])
    gold = {"recipient": who, "message": msg}
    text = (f"调用 send_message：给{who}发消息，内容是“{msg}”。" if zh else
            f"Call send_message: text {who} \"{msg}\".")
    return text, SEND, gold


def items() -> Iterator[dict[str, Any]]:
    rng = random.Random(6)
    for zh in (False, True):
        lang = "zh" if zh else "en"
        for i in range(10):
            text, gold = _health(rng, i, zh)
            yield {"id": f"health-{lang}-{i}", "lang": lang, "scenario": "health", "input": text,
                   "schema": HEALTH, "gold": gold}
        for i in range(10):
            text, gold = _receipt(rng, i, zh)
            yield {"id": f"receipt-{lang}-{i}", "lang": lang, "scenario": "receipt", "input": text,
                   "schema": RECEIPT, "gold": gold}
        for i in range(10):
            text, gold = _schedule(rng, i, zh)
            yield {"id": f"schedule-{lang}-{i}", "lang": lang, "scenario": "schedule", "input": text,
                   "schema": SCHEDULE, "gold": gold}
        for i in range(10):
            text, schema, gold = _tool(rng, i, zh)
            yield {"id": f"tool-{lang}-{i}", "lang": lang, "scenario": "tool_call", "input": text,
                   "schema": schema, "gold": gold}
        for i, (label, text) in enumerate(ZH_CLASSIFY if zh else EN_CLASSIFY):
            yield {"id": f"classify-{lang}-{i}", "lang": lang, "scenario": "classify", "input": text,
                   "schema": CLASSIFY, "gold": {"label": label}}


if __name__ == "__main__":
    for item in items():
        print(json.dumps(item, ensure_ascii=False))
